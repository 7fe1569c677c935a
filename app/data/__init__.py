"""Data: records and chat masks, the tokenized dataset, the job schedule, a job's forward through the target
(target_forward), target generation."""
