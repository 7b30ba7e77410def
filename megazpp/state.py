"""The one name for a state dict: what a `state_dict()` gives and a `load_state_dict()` takes.

Why its values stay untyped: a state dict holds tensors, numbers, strings, None and nested state
dicts side by side (the engine's buckets, its loss scaler, the outer exchange, a checkpoint's
rank file), read back by key by the code that wrote it; a tighter value type would need a cast
at every read and check nothing more. The name says what the dict is.
"""

from typing import Any, TypeAlias

StateDict: TypeAlias = dict[str, Any]
