"""The engine-facing API: one rank's side of each request's KV handover, in process.

An engine embeds one :class:`~workers.agent.Worker` per rank. The lifecycle is close to vLLM's KV
connector (the scheduler decides, the worker side starts sends and loads, a poll reports what
finished), so a thin adapter plugs it into such an engine:

1. **attach and start** (slow path, once): ``worker.attach(tensors={pool_id: tensor})`` registers
   the rank's KV memory with NIXL and the control plane; ``worker.start()`` pulls the worker's
   *directory* (the compiled templates of every pairing that involves its instance, for every DP
   combination, and its peers' NIXL endpoints) and keeps it current through the heartbeat.
2. **per request** (hot path, no database, no control-plane round trip): every context rank calls
   ``worker.send(request_id, peer, blocks)`` and every generation rank
   ``worker.expect(request_id, peer, blocks)``; both get a :class:`Handle` at once. ``blocks`` is
   the same map on both sides, ``{layer_group: (context_ids, generation_ids)}`` (or the REST form
   ``{"0": {"context": [...], "generation": [...]}}``): a router hands the request's two block
   tables to both engines, with ``num_tokens`` (the prompt tokens that move): blocks pair by
   token position from the start of the request (:mod:`geometry.align`; a block-size ratio
   runs as the lanes of :func:`~workers.executors.align_request`). Each rank computes its own
   routes from the cached templates; nothing coordinates them. A per-request state group
   (Mamba/SSM conv and SSM state,
   ``tokens_per_slot: null``) takes the request's state slot on each side, ``([slot], [slot])``
   (``[]`` on a side: move no state); it rides the same routes and staging.
3. **progress**: one thread per worker drives NIXL. The receiver knows from the plan who writes
   how many bytes, so it allocates a staging area per writer from its own buffer (no reservation
   round trip) and *grants* it to that writer in a NIXL notification. The writer gathers its
   route chunk by chunk into its own staging and WRITEs each chunk into the granted area with a
   notification; the receiver scatters each chunk into its blocks as it lands. In ``fragments``
   mode the grant only says "ready", and the writer posts one descriptor per fragment straight
   into the receiver's pools.
4. **outcome**: the receiver's handle becomes ``arrived`` when every writer's bytes are in its
   blocks; the sender's becomes ``released`` when its WRITEs completed (its context blocks may be
   freed); either becomes ``failed`` with a reason: its deadline passed, a peer restarted (a
   notification from an old agent or epoch), the peer aborted, or the blocks were bad. Failures
   are told to the other side at once (an abort notification), so neither waits for its
   deadline when the other already knows. Wait on a handle (``wait``), poll it (``done``,
   ``state``), give it a callback, or poll :meth:`Handover.get_finished`.
5. **record**: finished handles go to the control plane in batches (``workers/records.py``); the
   record never blocks a transfer and catches up after a control-plane outage.

Who owns what (:class:`Handover` holds one of each part and wires them together; each part sets
its own state in its own ``__init__``, and the others change it only through its methods):

- :mod:`.engine_api`: :class:`Handover`, the calls above (``send``, ``expect``, ``release``,
  ``refuse``, ``get_finished``, ``set_directory``, ``close``), the progress thread that drives
  them and the dispatch of each notification to the part it is for;
- :mod:`.handles`: :class:`Handle` and its lifecycle (step 4: complete, fail, abort, deadline),
  held by ``Handover.handles`` (:class:`~.handles.Handles`: the pending requests and their
  routes by key);
- :mod:`.grants`: the grant exchange of step 3 (staged and fragments mode, asks, re-sent grants,
  probes), ``Handover.grants``;
- :mod:`.peers`: the peer workers, their NIXL endpoints and, through :mod:`.reloads`, the ones
  whose connection failed, ``Handover.peers``;
- :mod:`.staging`: the staging areas a grant hands out, and their quarantine, ``Handover.areas``;
- :mod:`.notices`: the notifications between the two sides and their wire format (no state);
- :mod:`.blocks`: the request's block map in both accepted forms.
"""

from workers.directory import HandoverError
from workers.handover.blocks import BlockMap, blocks_of, normalize_blocks
from workers.handover.engine_api import DEFAULT_TIMEOUT_S, Handover
from workers.handover.grants import AUTO_FRAGMENT_BYTES, MODES, route_mode_of
from workers.handover.handles import ARRIVED, FAILED, PENDING, RELEASED, Finished, Handle
from workers.handover.notices import Ask
from workers.handover.staging import CHUNK_BLOCKS, StagingAreas

__all__ = [
    "ARRIVED",
    "AUTO_FRAGMENT_BYTES",
    "CHUNK_BLOCKS",
    "DEFAULT_TIMEOUT_S",
    "FAILED",
    "MODES",
    "PENDING",
    "RELEASED",
    "Ask",
    "BlockMap",
    "Finished",
    "Handle",
    "Handover",
    "HandoverError",
    "StagingAreas",
    "blocks_of",
    "normalize_blocks",
    "route_mode_of",
]
