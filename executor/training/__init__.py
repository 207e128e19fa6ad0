"""Training what speculative decoding drafts with (a distilled draft model, Medusa heads), on engines the core
builds."""
