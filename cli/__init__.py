"""The ``kvplane`` command line, above the server it drives (nothing in the server imports it).

- :mod:`.main`: the root command (``kvplane``, also ``python -m cli``): ``serve``,
  ``migrate``, ``check``, ``describe``, ``worker``, ``demo``; it adds the two families below;
- :mod:`.ops`: operator commands against a running control plane through :mod:`api.client`
  (``instances``, ``pairings``, ``plan``, ``transfers``, ``workers``);
- :mod:`.tokens`: ``kvplane tokens``, API tokens made directly on the database;
- :mod:`.check`: ``kvplane check``, the offline pairing check (validation and plan, no server);
- :mod:`.describe` and :mod:`.describe_hybrid`: ``kvplane describe``, registration bodies from
  Hugging Face style model configs;
- :mod:`.demo`: ``kvplane demo``, the main job end to end on the reference engine
  (:mod:`workers.testing.engine`).
"""
