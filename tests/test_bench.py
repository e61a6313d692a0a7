"""The benchmark's prompt rule and metrics (numbers are not asserted, only meaning)."""

import pytest
from conftest import FakeTokenizer, random_heads

from clp_mlx.bench import bench, main, repetition_ratio, wikitext_prompts
from clp_mlx.errors import ClpError

ARTICLES = """ = First article =

 First paragraph of one .

 = = Section = =

 More text .
 = Second article =

 Opening of two .
"""


def test_prompts_are_first_paragraphs_of_articles(tmp_path):
    path = tmp_path / "wiki.test.raw"
    path.write_text(ARTICLES)
    assert wikitext_prompts(str(path), 5) == ["First paragraph of one .", "Opening of two ."]


def test_repetition_ratio():
    assert repetition_ratio([1, 2, 3, 4, 5]) == 0.0
    assert repetition_ratio([7, 7, 7, 7, 7]) == 1 - 1 / 3
    assert repetition_ratio([1, 2]) == 0.0


def test_verify_rows_are_identical_to_ar(model):
    heads = random_heads(model, 2, seed=2, scale=0.3)
    table = bench(
        model,
        FakeTokenizer(),
        heads,
        ["abc", "hello"],
        ["ar", "verify", "fixed"],
        max_tokens=12,
        prompt_tokens=8,
    )
    assert table["verify"]["identical_to_ar"] == 1.0 and table["ar"]["speedup"] == 1.0
    assert table["fixed"]["tokens_per_pass"] == 3.0  # 12 tokens, 3 per pass


def test_bad_prompt_files_are_clear_errors(tmp_path):
    with pytest.raises(ClpError, match="does not exist"):
        main(["--wikitext", str(tmp_path / "missing.raw")])
    with pytest.raises(ClpError, match="exactly one"):
        main([])
