"""Test and bench equipment, kept apart from the data path (nothing else in ``workers`` imports it).

- :mod:`.engine`: the reference engine, a fake engine per rank that owns its KV tensors and
  embeds a :class:`~workers.agent.Worker`, with the control plane and rank processes to drive it
  (``kvplane demo``, ``tests/workers``, ``tests/multihost``, ``bench/``);
- :mod:`.netbed`: several hosts on one machine (network namespaces with a control and a data
  NIC, on two bridges) and the network faults the tests inject (``make hosts-up``);
- :mod:`.oracles`: hand-built head-slice templates and the naive byte oracles the executors are
  checked against.
"""
