"""What several scenario folders share, below every one of them: a scenario folder imports from here
(and from base.py and lower layers), never from another scenario's folder (docs/architecture.md).
"""
