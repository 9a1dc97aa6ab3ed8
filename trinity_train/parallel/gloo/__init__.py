"""Communication that only a CPU job with gloo runs: the collectives gloo lacks or does wastefully,
and the overlaps FSDP2 gets from CUDA streams on a GPU. Nothing here runs on a GPU; a job reaches
it through one call, `install_gloo_communication`, and one object its step holds,
`GlooCommunication` (communication.py).
"""
