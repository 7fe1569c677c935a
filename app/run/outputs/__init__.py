"""What a run writes and shows: the status line and counters (`monitor.py`), the timeline of step and pool
records (`timeline.py`), wandb rows (`wandb_log.py`), report.html (`report_page.py`, its plots `report_plots.py`),
and the wiring of them into the driver with the served export's summary (`run_outputs.py`)."""
