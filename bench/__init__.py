"""`checknrun bench`: the measurements behind the README's figures, each part runnable alone.

Parts (each a module with `run(quick: bool) -> dict`): `paper` (bytes per interval and storage
of every policy x codec, replayed from one training run per workload), `accuracy` (served model
and restores from quantized checkpoints, and the bit-width rule derived from them), `stall`
(checkpoint stall next to torch.save and DCP async_save, restore next to torch.load), `codec`
(bench.codec_measure) and `freshness` (bench.serving through Kafka + MinIO when set up).
"""
