"""Evaluations beyond the validation loss: the passkey retrieval probe of long-context training
(`passkey`) and its command on a checkpoint (`command`)."""
