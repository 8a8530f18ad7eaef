"""A discrete-event simulator of a swarm that runs the project's real decision code (issue 39).

The swarm's choices are made by the imported functions, never re-written here: ``worker.block_selection``
(where a joining server goes), ``worker.rebalance`` (``balancing_view``, ``plan_move``, ``jittered``,
``joining_range``, ``retired_ranges``, ``tombstone``: when and where a running server moves),
``swarm_client.routing`` (``find_route``, ``coverage``, ``missing_blocks``), ``swarm_client.bans``
(``BanList``, ``ban_verdict``) and ``swarm_client.dht_records`` (``ServerInfo``, ``spans_from_records``).
Those functions take plain inputs and, where they read a clock, a ``now`` argument; the simulator passes its
simulated time, so nothing is monkeypatched.

Modules, one job each: ``events`` (the event queue), ``inputs`` (hardware and latency tables, with sources),
``dht`` (per-block records with expiry, read/write counters), ``swarm`` (servers: join, announce, rebalance,
crash, leave, slow), ``clients`` (sessions: route, fail, ban, re-route), ``metrics`` (throughput against its
bound, route quality), ``run`` (one scenario), ``report`` (Markdown + SVG). Run: ``python -m load_tests.swarm_sim``.
"""
