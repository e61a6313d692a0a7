"""Training drafters on the backbone's own outputs: features, heads, CLP and gate."""
