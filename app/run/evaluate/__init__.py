"""Evaluation during and after a run: when to evaluate (`schedule.py`), running one on an idle target and
keeping the best drafter (`runner.py`), and the final tau on held-out prompts (`final_tau.py`)."""
