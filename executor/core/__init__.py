"""The engine core: the engine's step (schedule, run the model runner, sample or verify, tell the scheduler), the
model runner, building an engine, and what a loop around it reads (the machine's load, host-memory tuning, prompts
as token ids). Imports the model and speculative decoding's drafters and verification."""
