"""What a job document records of its place in a Celery canvas (a chain, a group, a chord), taken at publish.

Celery's task message says where the task stands in its canvas: `root_id` (the first task of the whole canvas: a task
sent on its own is its own root), `parent_id` (the task that sent it: the previous step of a chain, the header task
that completed a chord), `group` and `group_index` (its group, a chord's header among them). A publish keeps them in
the job's `rootId`, `parentId`, `groupId` and `groupIndex`, so that bb_broker.ops.canvas finds a canvas's steps
through ROOT_INDEX and GROUP_INDEX, in bounded reads. `parentId` and `groupId` are the fields the result backend
writes at the settle too (results/backend.py, from the same headers): a publish only writes them earlier.

The steps still to be published are not recorded apart: they are in the payload already, in the embed's `chain`,
`callbacks`, `errbacks` and `chord` (payloads.check_body checks their shape at publish), where the canvas reads them.

A header that is not such an id (not a string, empty, longer than MAX_CANVAS_ID_LENGTH) is left out of the job: it is
the canvas's record that loses it, never the task's publish.
"""

from __future__ import annotations

from typing import Any, TypeGuard

from pymongo import ASCENDING, IndexModel

#: The longest id a canvas field keeps (Celery's are 36-character UUIDs; a task id may be chosen by its sender): the
#: longest filter value (bb_broker.ops.operations.MAX_FILTER_LENGTH), so that `root=` takes any root.
MAX_CANVAS_ID_LENGTH = 200
#: The most a group index may be (a group of more tasks than this is not drawn member by member anyway).
MAX_GROUP_INDEX = 2**31 - 1

#: Celery's header → the job's field.
CANVAS_HEADERS = {"root_id": "rootId", "parent_id": "parentId", "group": "groupId"}

#: The steps of one canvas, oldest first (a job id is a ULID, in publish order); partial, as bb_list_schedule is.
ROOT_INDEX = IndexModel(
    [("rootId", ASCENDING), ("_id", ASCENDING)],
    name="bb_canvas_root",
    partialFilterExpression={"rootId": {"$exists": True}},
)
#: The members of one group. Celery gives each task of a group sent on its own (a chord's header too) itself as its
#: root: the group id is what joins them, and the chord's body (whose root is one of them) to them.
GROUP_INDEX = IndexModel(
    [("groupId", ASCENDING), ("_id", ASCENDING)],
    name="bb_canvas_group",
    partialFilterExpression={"groupId": {"$exists": True}},
)
CANVAS_INDEXES = [ROOT_INDEX, GROUP_INDEX]


def is_canvas_id(value: Any) -> TypeGuard[str]:
    """Whether `value` is an id a canvas field keeps: a non-empty string of at most MAX_CANVAS_ID_LENGTH."""
    return isinstance(value, str) and 0 < len(value) <= MAX_CANVAS_ID_LENGTH


def canvas_fields(headers: dict[str, Any]) -> dict[str, Any]:
    """The job's canvas fields from a task message's headers: each one that is a canvas id (is_canvas_id), and the
    group index when it is a whole number in range; the others left out."""
    fields = {field: headers[name] for name, field in CANVAS_HEADERS.items() if is_canvas_id(headers.get(name))}
    index = headers.get("group_index")
    if "groupId" in fields and isinstance(index, int) and not isinstance(index, bool) and 0 <= index <= MAX_GROUP_INDEX:
        fields["groupIndex"] = index
    return fields
