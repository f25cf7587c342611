"""Which modules become stage-3 gather units, and which unit owns each parameter.

A unit is a module subtree whose parameters are all-gathered together right before the module's forward (and
backward) and freed right after. The root unit holds every parameter outside the chosen subtrees and is gathered
around the whole model's forward.

Note [parameters read outside forward]
Gathering is triggered by a unit module's own ``forward``. A parameter that some *other* module reads directly, say
``nn.MultiheadAttention`` reading ``out_proj.weight`` without calling ``out_proj``, must therefore live in a unit
whose forward encloses that read. Two rules guarantee it for the cases we know: no unit is ever created inside an
``nn.MultiheadAttention``, and a parameter registered by modules of several units (tied weights such as an input
embedding and an output projection) is owned by the innermost unit that contains all of them.
"""

from __future__ import annotations

from collections import Counter

from torch import nn

from lightning_zero.config import ZeroConfig

# Modules whose own forward reads their children's parameters directly: never split them into several units.
_LEAF_UNITS: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)


def _class_matches(module: nn.Module, names: tuple[str, ...]) -> bool:
    cls = type(module)
    return cls.__name__ in names or f"{cls.__module__}.{cls.__qualname__}" in names


def _check_classes_exist(root: nn.Module, names: tuple[str, ...]) -> None:
    # A misspelled class would silently leave the whole model in the root unit: every rank would gather all of it.
    missing = [n for n in names if not any(_class_matches(m, (n,)) for m in root.modules())]
    if missing:
        present = sorted({type(m).__name__ for m in root.modules()})
        raise ValueError(
            f"Invalid ZeroConfig.wrap_module_classes: {missing} name no module class of {type(root).__name__} "
            f"(its classes: {present}). HINT: use a class name from that list, e.g. ('Block',), or None to wrap "
            "the repeated layers automatically."
        )


def _repeated_layers(root: nn.Module) -> set[int]:
    """ids of modules that sit in a ModuleList/Sequential next to siblings of the same class (transformer layers)."""
    chosen: set[int] = set()
    for module in root.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            counts = Counter(type(child) for child in module.children())
            chosen.update(id(child) for child in module.children() if counts[type(child)] > 1)
    return chosen


def find_unit_roots(root: nn.Module, config: ZeroConfig) -> list[tuple[str, nn.Module]]:
    """The modules (with qualified names, in forward-registration pre-order) that become units, the root excluded."""
    by_class = _repeated_layers(root) if config.wrap_module_classes is None else set()
    names = config.wrap_module_classes or ()
    _check_classes_exist(root, names)
    chosen: set[int] = set()

    def visit(module: nn.Module, inside_leaf_unit: bool) -> int:
        """Returns the parameter elements of ``module`` not yet claimed by a unit below it."""
        leaf = inside_leaf_unit or isinstance(module, _LEAF_UNITS)
        remaining = sum(p.numel() for p in module.parameters(recurse=False))
        for child in module.children():
            remaining += visit(child, leaf)
        if module is root or inside_leaf_unit:
            return remaining
        by_size = config.wrap_min_numel > 0 and remaining >= config.wrap_min_numel
        if remaining > 0 and (id(module) in by_class or _class_matches(module, names) or by_size):
            chosen.add(id(module))
            return 0
        return remaining

    visit(root, inside_leaf_unit=False)
    return [(name, m) for name, m in root.named_modules() if id(m) in chosen]


def assign_parameters(root: nn.Module, unit_roots: list[tuple[str, nn.Module]]) -> list[list[tuple[str, nn.Parameter]]]:
    """Each unit's parameters (index 0 is the root unit, then ``unit_roots`` in order), each parameter once.

    See Note [parameters read outside forward] for who owns a parameter shared between units.
    """
    unit_of_module: dict[int, int] = {}
    chain_of_unit: dict[int, list[int]] = {0: [0]}  # unit -> its enclosing units, outermost first

    def visit(module: nn.Module, unit: int) -> None:
        unit_of_module[id(module)] = unit
        for child in module.children():
            child_unit = unit
            for i, (_, candidate) in enumerate(unit_roots, start=1):
                if candidate is child:
                    child_unit = i
                    chain_of_unit[i] = [*chain_of_unit[unit], i]
                    break
            visit(child, child_unit)

    visit(root, 0)
    owners: dict[int, list[int]] = {}
    first_name: dict[int, tuple[str, nn.Parameter]] = {}
    for module_name, module in root.named_modules(remove_duplicate=False):
        for param_name, p in module.named_parameters(recurse=False):
            fqn = f"{module_name}.{param_name}" if module_name else param_name
            first_name.setdefault(id(p), (fqn, p))
            owners.setdefault(id(p), []).append(unit_of_module[id(module)])

    units: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(len(unit_roots) + 1)]
    for pid, (fqn, p) in first_name.items():
        chains = [chain_of_unit[u] for u in owners[pid]]
        common = 0
        for depth in range(min(len(c) for c in chains)):
            if len({c[depth] for c in chains}) > 1:
                break
            common = chains[0][depth]
        units[common].append((fqn, p))
    return units
