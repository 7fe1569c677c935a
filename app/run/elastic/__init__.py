"""Deciding and carrying out the split between targets and drafters while a run goes on. Each decision
is a pure module beside its Ray shell, named as a pair: the advisor (`advisor.py`) measures both sides;
`resplit.py` / `resplit_shell.py` move GPUs between them, `grow.py` / `grow_shell.py` take back bundles
lost with a node, `extra.py` / `extra_shell.py` add free cluster GPUs to the short side. `planners.py` builds
a run's deciders once, for its monitor and its shells alike."""
