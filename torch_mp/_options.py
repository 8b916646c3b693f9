"""Layer options as the C++ core declares them (csrc/torch_mp/options.h).

Each torch_mp layer declares its options once, in C++: one list of names, types and defaults,
from which the C++ ``Options`` struct and the operator's schema are generated. A Python module
built on :class:`DeclaredOptions` derives the rest from the same declaration
(``torch_mp._C.declared_options``):

- its constructor's signature: the declared names in order, with their defaults, required ones
  first, "keyword" ones keyword-only; ``device`` and ``dtype`` after them;
- the options it hands its operator (``torch.ops.torch_mp.<op>(..., **self._operator_options())``,
  the operator's keyword-only arguments) and the construction-time check
  (``torch_mp._C.check_options``);
- the options ``from_dense`` takes: those the dense module does not determine;
- the options of the layers it is made of (``torch_mp._C.child_options``: what the C++ module
  builds its children with).

Every option is an attribute of the module (``layer.sequence_parallel``), except one whose name
is a parameter's (``bias``: whether the parameter exists) and one renamed where its name is a
submodule's (``_ATTRIBUTES``). A group option holds a ``ProcessGroup`` (or None) and reaches the
core by name.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from torch_mp import _C

_KINDS = {
    "required": inspect.Parameter.POSITIONAL_OR_KEYWORD,
    "option": inspect.Parameter.POSITIONAL_OR_KEYWORD,
    "keyword": inspect.Parameter.KEYWORD_ONLY,
}


@dataclass(frozen=True)
class Option:
    """One declared option."""

    name: str
    kind: str  # "required", "option" or "keyword"
    type: str  # a schema type ("int", "float?", "int[2]", "Any", ...) or "group"
    default: Any

    @property
    def required(self) -> bool:
        return self.kind == "required"


class Declaration:
    """The options layer ``name`` declares in the C++ core."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.options = tuple(Option(*o) for o in _C.declared_options(name))
        self.names = tuple(o.name for o in self.options)
        self.groups = frozenset(o.name for o in self.options if o.type == "group")
        self.strings = frozenset(o.name for o in self.options if o.type == "str")
        self.signature = inspect.Signature([self.parameter(o) for o in self.options])
        # The constructor's: device and dtype after the options.
        self.constructor_signature = self.signature.replace(
            parameters=[
                *self.signature.parameters.values(),
                *(
                    inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
                    for name in ("device", "dtype")
                ),
            ]
        )

    @staticmethod
    def parameter(option: Option) -> inspect.Parameter:
        """``option`` as a Python parameter (a group's default is None)."""
        default = inspect.Parameter.empty if option.required else option.default
        return inspect.Parameter(option.name, _KINDS[option.kind], default=default)

    def bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """The options ``args`` and ``kwargs`` give (defaults filled in), as the constructor
        binds them; raises TypeError naming the layer."""
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{self.name}: {e}") from None
        bound.apply_defaults()
        return dict(bound.arguments)


class _ClassSignature:
    """The constructor's signature on the class (``inspect.signature(Layer)``, help()); an
    instance keeps the usual signature of a callable module."""

    def __get__(self, instance, owner):
        if instance is not None:
            raise AttributeError("__signature__")
        return owner._declaration.constructor_signature


class DeclaredOptions:
    """Mixin of a module whose options the C++ core declares under ``declared=`` (the class
    keyword): ``class ParallelMLP(DeclaredOptions, nn.Module, declared="ParallelMLP")``.

    The subclass's ``__init__(self, *args, device=None, dtype=None, **kwargs)`` calls
    :meth:`_take_options` first; its ``from_dense(dense, *args, **kwargs)`` calls
    :meth:`_from_dense` with the options the dense module determines.
    """

    _declaration: Declaration
    # Options given by position to from_dense after the dense module, in this order (the rest
    # by keyword): each layer's established from_dense signature.
    _FROM_DENSE_POSITIONAL: tuple[str, ...] = ("group",)
    # Options that name a parameter of the module itself: the option is the parameter's presence.
    _PARAMETER_OPTIONS: frozenset[str] = frozenset()
    # Options kept under another attribute (where the option's name is a submodule's).
    _ATTRIBUTES: dict[str, str] = {}
    __signature__ = _ClassSignature()

    def __init_subclass__(cls, declared: str | None = None, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if declared is not None:
            cls._declaration = Declaration(declared)

    def _take_options(self, args: tuple, kwargs: dict, **resolved) -> dict[str, Any]:
        """Binds the constructor's arguments to the declared options, sets each as an
        attribute and returns them. ``resolved`` maps option names to functions that turn the
        given value into the one kept (a group's default, say)."""
        options = self._declaration.bind(args, kwargs)
        for name, value in options.items():
            if name in self._declaration.strings and value is None:
                value = options[name] = ""  # None for an empty string option
            if name in resolved:
                value = options[name] = resolved[name](value)
            if not self._is_parameter_option(name):
                setattr(self, self._ATTRIBUTES.get(name, name), value)
        return options

    def _is_parameter_option(self, name: str) -> bool:
        """Whether option ``name`` is whether a parameter of that name exists (``bias``)."""
        return name in type(self)._PARAMETER_OPTIONS

    def _check_options(self, options: dict[str, Any]) -> None:
        """The core's construction-time check of ``options`` (sizes, rank agreement)."""
        _C.check_options(self._declaration.name, self._for_core(options))

    def _for_core(self, options: dict[str, Any]) -> dict[str, Any]:
        """``options`` as the core takes them: groups by name, "" for none."""
        groups = self._declaration.groups
        return {
            name: ("" if value is None else value.group_name) if name in groups else value
            for name, value in options.items()
        }

    def options(self) -> dict[str, Any]:
        """The module's options by name, as the constructor takes them."""
        return {
            name: (
                getattr(self, name) is not None
                if self._is_parameter_option(name)
                else getattr(self, self._ATTRIBUTES.get(name, name))
            )
            for name in self._declaration.names
        }

    def _children(self, **classes: type[DeclaredOptions]) -> dict[str, dict[str, Any]]:
        """The options of the layers this one is made of, by attribute (``classes`` maps each
        attribute to its layer's class), as the core derives them from this layer's options
        (``_C.child_options``: what the C++ module builds its children with). Their groups are
        this layer's."""
        made = _C.child_options(self._declaration.name, self._operator_options())
        if set(made) != set(classes):
            raise RuntimeError(
                f"{self._declaration.name}: the core builds {sorted(made)}, not {sorted(classes)}"
            )
        mine = [getattr(self, name) for name in self._declaration.groups]
        groups = {g.group_name: g for g in mine if g is not None}
        return {
            attribute: {
                name: (groups[value] if value else None)
                if name in classes[attribute]._declaration.groups
                else value
                for name, value in options.items()
            }
            for attribute, options in made.items()
        }

    def extra_repr(self) -> str:
        """The options (groups aside) and the tensor-parallel size."""
        shown = [
            f"{k}={v!r}" for k, v in self.options().items() if k not in self._declaration.groups
        ]
        if hasattr(self, "tp_size"):
            shown.append(f"tp_size={self.tp_size}")
        return ", ".join(shown)

    def _operator_options(self) -> dict[str, Any]:
        """The options as the layer's operator takes them (its keyword-only arguments)."""
        return self._for_core(self.options())

    @classmethod
    def _from_dense(cls, dense, args: tuple, kwargs: dict, taken: dict[str, Any]):
        """A layer with the options ``taken`` from ``dense`` and the others from ``args``
        (by position, as ``_FROM_DENSE_POSITIONAL``) and ``kwargs``, built on the meta device
        to be given storage and loaded by the caller."""
        if len(args) > len(cls._FROM_DENSE_POSITIONAL):
            raise TypeError(
                f"{cls.__name__}.from_dense takes at most {len(cls._FROM_DENSE_POSITIONAL)} "
                f"options by position ({', '.join(cls._FROM_DENSE_POSITIONAL)})"
            )
        given = dict(zip(cls._FROM_DENSE_POSITIONAL, args, strict=False))
        for name, value in kwargs.items():
            if name in given:
                raise TypeError(f"{cls.__name__}.from_dense: '{name}' given twice")
            given[name] = value
        for name in given:
            if name in taken:
                raise TypeError(
                    f"{cls.__name__}.from_dense: '{name}' is the dense module's (set it there)"
                )
            if name not in cls._declaration.names:
                raise TypeError(f"{cls.__name__}.from_dense: no option '{name}'")
        return cls(**taken, **given, device="meta")
