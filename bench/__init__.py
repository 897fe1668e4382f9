"""Benchmarks of lightning_fpdt, run from the repository root (bench/README.md says what each one measures).

``bench.peers`` trains the reference Llama with this project and with its two peers; ``bench.report`` turns the JSON
records in bench/results/ into docs/benchmarks.md. The other modules are scripts, run from the repository root as
modules (``python3 -m bench.attention``).
"""
