"""Contract suites: what every backend of one interface must do, run once per backend.

Each suite parametrizes one fixture over the backends (`store`: file, s3; `bus`: file-log,
kafka). A backend that needs the shared services carries the `integration` marker on its
parameter, so the quick tier runs the suite on the embedded backend alone. A new backend adds
one factory and one parameter; what only one backend does stays in that backend's own tests.
"""
