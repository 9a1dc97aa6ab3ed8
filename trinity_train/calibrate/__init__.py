"""`trinity-train calibrate`: the job's own nodes measured into a hardware profile
(`plan/profile.py`) that `trinity-train plan --hardware PROFILE` prices with: links by collective
kind and size (`links.py`), compute and memory at the config's shapes (`compute.py`), the command
(`command.py`)."""
