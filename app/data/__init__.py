"""Data: records and chat masks, the tokenized dataset, the job schedule, batching, target generation."""
