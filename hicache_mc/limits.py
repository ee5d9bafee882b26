"""What one wire message may hold: the limits, and the bounded types protocol.py builds its
messages from (msgspec checks each container's declared length before reading its elements)."""
from __future__ import annotations

from typing import Annotated, Union

from msgspec import Meta

# Limits on what a peer can make a service decode. Every container and string in a request has
# a maximum length, which msgspec checks at its header, before reading its elements: work on a
# frame is bounded by the schema, not by what the peer sends. Measured on a 2-core VM against
# the VERSION 7 decoder (msgpack.unpackb, then per-field checks), same run, same content: a
# frame of ~16M empty arrays inside every per-container limit of that decoder (MAX_KEYS lists
# of 120 empty lists as the keys, or as the values of a MAX_KEYS-entry fence or stats map) kept
# it busy 6-10 s and is refused here ~3e5 times sooner, allocating < 0.1 MiB; arrays or maps
# of 8-16M entries and 5-16M-deep nesting are refused as fast. No frame that passes costs more
# than an honest CommittedRequest of MAX_KEYS keys. Decode time relative to the old decoder:
# ExistsRequest of 128 keys 0.47x, of MAX_KEYS keys 0.70x; CommittedRequest of MAX_KEYS keys
# 0.60x; the largest heartbeat stats (MAX_FIELDS x MAX_TENANTS entries; as costly as that
# CommittedRequest) 0.95x.
#
# SGLang's hybrid controller probes every page of a request in one call: 128k keys = 4M tokens
# at page size 64 with K and V objects.
MAX_KEYS = 1 << 17
# Longer keys are refused (the SSD record header holds up to 65535 bytes). Counted in
# characters, which are bytes for the ASCII keys hicache-mc makes.
MAX_KEY_BYTES = 1024
# A frame's size limit: the largest honest message is a lookup (Exists/Contains/Locate) of
# MAX_KEYS keys. A store key is "<16 hex>[@tenant]/<64 hex>/<part>": 84 bytes, 149 with a
# 64-character tenant, 151 with its msgpack header: 131072 x 151 B = 18.9 MiB (10.7 MiB with
# no tenant). Node inventories go in CommittedRequest batches of 4096 keys (~0.4 MiB). A bigger
# frame is refused before it is decoded (services also give this to ZeroMQ as its maximum
# message size). A string is measured once decoded: an over-long key costs one copy of it
# (0.5x the old decoder's time for a 15 MiB key).
MAX_HEADER_BYTES = 20 << 20
MAX_NAME = 4096          # node ids, hosts, segment ids, epochs, paths, error codes
MAX_TEXT = 1 << 16       # an ErrorReply's message
MAX_NODES = 1024         # node records in a reply; entries in a lookup's fence
MAX_FIELDS = 128         # entries in a node record or in stats (a node sends ~30)
# Tenants in a node's stats and in a heartbeat's quotas (a node reporting more must sum the
# rest under one entry): MAX_FIELDS x MAX_TENANTS = MAX_KEYS nested entries at most.
MAX_TENANTS = 1024
MAX_REPLICAS = 8         # copies of one object a writer may ask for

Key = Annotated[str, Meta(max_length=MAX_KEY_BYTES)]
Name = Annotated[str, Meta(max_length=MAX_NAME)]
Text = Annotated[str, Meta(max_length=MAX_TEXT)]
# msgpack's ints span -2^63..2^64-1, so ge=0 is the whole u64 range
U64 = Annotated[int, Meta(ge=0)]
Keys = Annotated[list[Key], Meta(max_length=MAX_KEYS)]
Ints = Annotated[list[int], Meta(max_length=MAX_KEYS)]             # sizes, offsets (per key)
Bools = Annotated[list[bool], Meta(max_length=MAX_KEYS)]
Checksums = Annotated[list[U64], Meta(max_length=MAX_KEYS)]
NodeIds = Annotated[list[Name], Meta(max_length=MAX_NODES)]
Replicas = Annotated[int, Meta(ge=1, le=MAX_REPLICAS)]
# per key, the nodes to write further copies to (a PlaceReply)
Copies = Annotated[list[Annotated[list[Name], Meta(max_length=MAX_REPLICAS)]],
                   Meta(max_length=MAX_KEYS)]
# read-your-writes fence: node id -> (segment id, the node's commit sequence number)
Fence = Annotated[dict[Name, tuple[Name, U64]], Meta(max_length=MAX_NODES)]
NodeRecord = Annotated[dict[Name, Union[Name, int, bool]], Meta(max_length=MAX_FIELDS)]
NodeRecords = Annotated[dict[Name, NodeRecord], Meta(max_length=MAX_NODES)]   # id -> record
TenantBytes = Annotated[dict[Key, int], Meta(max_length=MAX_TENANTS)]       # tenant -> bytes
# a node's counters: flat, except "tenants" (TenantBytes)
NodeStats = Annotated[dict[Name, Union[int, float, Name, bool, TenantBytes]],
                      Meta(max_length=MAX_FIELDS)]
