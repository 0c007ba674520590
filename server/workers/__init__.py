"""`checknrun serve --workers N`: N request processes serving one copy of the model from shared
memory (docs/SERVER.md, "All cores: --workers").

    serve_with_workers(settings)          # the CLI's entry: spawns, serves, supervises

Process 0 is the apply side (it follows the versions, as a one-process server does) and serves
requests too; processes 1..N-1 serve requests from mirrors of its two copies. Roles:

- server/workers/gate.py: the shared live index and per-process reader counts (`ReadGate`);
- server/workers/messages.py: what the apply side sends a worker (a copy, a copy's row writes);
- server/workers/shared_slot.py: the apply side's double buffer, publishing to the workers;
- server/workers/mirror.py: a worker's mirrors of the copies, and its view of the live model;
- server/workers/processes.py: spawning, the listening socket, supervision.
"""

from server.workers.processes import serve_with_workers

__all__ = ["serve_with_workers"]
