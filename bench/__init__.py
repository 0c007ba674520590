"""The measurement floor on top of the product packages: benchmarks, the demo, test fixtures.

`checknrun bench PART` (bench/cli.py) runs one part, a module each: `paper`, `accuracy`,
`stall` (its off/on arms in `stall_arms`), `codec`, `freshness`, `restore`, `transport` and
`serving`; `report` turns their JSON documents into docs/benchmarks/RESULTS.md and plots. Shared
by the parts: `workloads` (the two training workloads), `machine` (the machine description every
result records), `bit_rule`. `demo` is `checknrun demo`; `child_server` starts `checknrun serve`
children for the demo, the benchmarks and the tests; `synthetic_run` publishes synthetic versions
for the serving benchmarks and the tests.
"""
