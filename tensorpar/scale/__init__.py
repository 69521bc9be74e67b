"""Scaling out: tensor parallelism inside a DeviceMesh ("dp", "tp"), data parallelism over "dp"
by torch's own FSDP2 or DDP. Imports the core packages only."""
