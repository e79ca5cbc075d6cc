"""A run judged against its reference: the two-lane comparison, its envelope and bounds, the judgement, the report."""
