"""Frozen slots dataclasses that build in half the instructions: the specs and the estimate's records.

A frozen dataclass's generated ``__init__`` stores each field with ``object.__setattr__`` (the frozen
class's own ``__setattr__`` refuses), which looks the field up again on every store. An estimate builds
an Estimate (16 fields), a TimeBreakdown (12) and a MemoryBreakdown (8) per pipeline rank it weighs;
stored through their slot descriptors instead, the estimator_speed grid runs 7.1 % fewer machine
instructions per estimate (386k against 415k, valgrind cachegrind, Python 3.11). Every planner candidate
also builds a TrainSpec (17 fields), a ParallelSpec (9) and a Setup (4), each validated by its
``__post_init__``, which this ``__init__`` calls as the generated one does.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import TypeVar

T = TypeVar("T")


def fast_init(cls: type[T]) -> type[T]:
    """``cls``, a frozen slots dataclass, with an ``__init__`` that stores each field through its slot
    descriptor: the same signature, defaults, objects and errors (a missing or unknown argument is a
    TypeError), and still frozen afterwards; a ``__post_init__`` is called last, as the dataclass's own
    ``__init__`` does. Classes with an InitVar, a default factory, or a field that is keyword-only or not
    in ``__init__`` are refused (TypeError), as this init has none of their handling. Apply it above
    ``@dataclass``."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"fast_init needs a frozen slots dataclass, not {cls.__name__}")
    init_args = list(inspect.signature(cls.__init__).parameters)[1:]
    if init_args != [f.name for f in dataclasses.fields(cls) if f.init]:
        raise TypeError(f"fast_init: {cls.__name__}.__init__ takes an InitVar, which this init would not pass on")
    namespace: dict[str, object] = {}
    args, stores = [], []
    for f in dataclasses.fields(cls):
        if f.default_factory is not dataclasses.MISSING or not f.init or f.kw_only:
            raise TypeError(f"fast_init: {cls.__name__}.{f.name} has a default factory, init=False or kw_only")
        namespace[f"_set_{f.name}"] = cls.__dict__[f.name].__set__
        if f.default is dataclasses.MISSING:
            args.append(f.name)
        else:
            namespace[f"_default_{f.name}"] = f.default
            args.append(f"{f.name}=_default_{f.name}")
        stores.append(f"    _set_{f.name}(self, {f.name})\n")
    if hasattr(cls, "__post_init__"):
        stores.append("    self.__post_init__()\n")
    body = "".join(stores) or "    pass\n"
    exec(f"def __init__(self, {', '.join(args)}):\n{body}", namespace)
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    cls.__init__ = init
    return cls
