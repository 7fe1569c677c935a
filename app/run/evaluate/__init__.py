"""Evaluation during and after a run: when to evaluate (`schedule.py`), running one on an idle target and
keeping the best drafter (`runner.py`), and the final tau on held-out prompts (`final_tau.py`). The decoding
itself is `app/model/drafter_tau.py`, which `python -m app.evaluate` (a drafter folder on its own) runs too."""
