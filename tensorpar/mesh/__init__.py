"""The device mesh and data parallelism around a tensor-parallel model: the ("dp", "tp") or
("pp", "dp", "tp") DeviceMesh (``mesh``) and torch's own FSDP2 or DDP over "dp"
(``data_parallel``). Imports the core packages and ``ranks`` (the check mode's question whether
a group checks its collectives) only."""
