"""The project's embedded datasets and the library's :class:`~fedparity.clients.shards.UserShard`
with the argument checks every population shares."""

from ...shards import SPLITS, UserShard, _check_choice, _check_partition, concat_shards

#: The populations embedded in the project app (run config ``dataset``).
DATASETS: tuple[str, ...] = ("synthetic", "adult")

__all__ = [
    "DATASETS",
    "SPLITS",
    "UserShard",
    "_check_choice",
    "_check_partition",
    "concat_shards",
]
