"""Which modules become stage-3 gather units, and which unit owns each parameter.

A unit is a module subtree whose parameters are all-gathered together right before the module's forward (and
backward) and freed right after. The root unit holds every parameter outside the chosen subtrees and is gathered
around the whole model's forward.

Note [parameters read outside forward]
Gathering is triggered by a unit module's own ``forward``. A parameter that some *other* module reads directly, say
``nn.MultiheadAttention`` reading ``out_proj.weight`` without calling ``out_proj``, must therefore live in a unit
whose forward encloses that read. Three rules guarantee it for the cases we know: no unit is ever created inside an
``nn.MultiheadAttention``; a module without a forward of its own (``nn.ModuleList``, ``nn.ModuleDict``) is never a
unit, since nothing calls it (its members may be); and a parameter registered by modules of several units (tied
weights such as an input embedding and an output projection) is owned by the innermost unit that contains all of
them.

Note [leaf modules]
A *leaf* module is never split into several units: no unit is created anywhere in its subtree, so it is gathered
whole with the unit that contains it (itself, if the policy makes it a unit). Ranks then issue the same gathers
whichever of its children each one calls. That is what the experts of a mixture need: each rank calls the experts
its tokens were routed to and skips the others (Hugging Face's sparse MoE blocks skip an expert that received no
token), and which ones changes from step to step. The merge of the first step (Note [data-dependent units] in
``divergence.py``) only sees the first step's routing; a leaf needs none.

Which modules are leaves is decided from the module tree, which every rank builds alike, never from routing:
``nn.MultiheadAttention`` always (Note [parameters read outside forward]); then the classes of
``ZeroConfig.leaf_module_classes`` if it is a tuple; if it is None, every non-empty ``nn.ModuleList`` or
``nn.ModuleDict`` (subclasses included) registered under a name containing "expert". That is where Hugging Face's
MoE blocks keep experts they may skip (``MixtralSparseMoeBlock.experts`` and ``Qwen2MoeSparseMoeBlock.experts``
before transformers 5 fused them into 3-D parameters, ``SwitchTransformersSparseMLP.experts`` and
``NllbMoeSparseMLP.experts``, a ``ModuleDict``), and so do most hand-written ones. The container is the leaf, not
the block around it: the router, a shared expert and whatever else the block holds are called on every rank and may
stay in units of their own, as may the layers next to a model-level ``experts`` list. Layers (``layers``, ``blocks``,
``h``) never match, so a transformer's decoder layers stay units. The cost of a leaf is that its experts are
gathered together, as the first-step merge would gather them anyway once the ranks route differently. Inside a leaf
no unit is made by any policy: a class of ``wrap_module_classes`` or a module over ``wrap_min_numel`` there stays
part of the leaf. A mixture the rule misses, if its routing parts ways only after the first step, raises
``RankDivergenceError`` naming the class to list (where the later check runs, by default on CPU:
Note [divergence check]); listing a class makes its whole block a leaf, as DeepSpeed's ``set_z3_leaf_modules`` does.
"""

from __future__ import annotations

from collections import Counter

from torch import nn

from lightning_zero.config import ZeroConfig
from lightning_zero.config_checks import check_classes_exist, class_matches
from lightning_zero.sharding.activation_checkpointing import state_dict_name

# Modules whose own forward reads their children's parameters directly: never split them into several units.
_LEAF_UNITS: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)


def is_experts_container(name: str, module: nn.Module) -> bool:
    """Whether ``module``, registered as ``name`` in its parent, is a non-empty ``ModuleList``/``ModuleDict`` of
    experts: the automatic rule for ``ZeroConfig.leaf_module_classes=None`` (Note [leaf modules])."""
    return isinstance(module, (nn.ModuleList, nn.ModuleDict)) and len(module) > 0 and "expert" in name.lower()


def is_leaf(name: str, module: nn.Module, config: ZeroConfig) -> bool:
    """Whether no unit may be created inside ``module``, registered as ``name`` in its parent (Note [leaf modules])."""
    if isinstance(module, _LEAF_UNITS):
        return True
    if config.leaf_module_classes is None:
        return is_experts_container(name, module)
    return class_matches(module, config.leaf_module_classes)


def leaf_modules(root: nn.Module, config: ZeroConfig) -> list[tuple[str, nn.Module]]:
    """The outermost leaf modules of ``root`` (Note [leaf modules]), with qualified names, in pre-order."""
    found: list[tuple[str, nn.Module]] = []

    def visit(path: str, name: str, module: nn.Module) -> None:
        if is_leaf(name, module, config):
            found.append((path, module))
            return
        for child_name, child in module.named_children():
            visit(f"{path}.{child_name}" if path else child_name, child_name, child)

    visit("", "", root)
    return found


def _has_forward(module: nn.Module) -> bool:
    """Whether ``module`` can be called: ``ModuleList``, ``ModuleDict`` and ``ParameterList`` cannot, so their own
    forward hooks would never gather them (Note [parameters read outside forward])."""
    return type(module).forward is not nn.Module.forward


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
    check_classes_exist(root, names, "wrap_module_classes", "e.g. ('Block',), or None to wrap the repeated layers")
    leaves = config.leaf_module_classes or ()
    check_classes_exist(root, leaves, "leaf_module_classes", "e.g. ('MoEBlock',), or None for containers of experts")
    chosen: set[int] = set()

    def visit(name: str, module: nn.Module, inside_leaf_unit: bool) -> int:
        """Returns the parameter elements of ``module`` (registered as ``name``) not yet claimed by a unit below."""
        leaf = inside_leaf_unit or is_leaf(name, module, config)  # Note [leaf modules]
        remaining = sum(p.numel() for p in module.parameters(recurse=False))
        for child_name, child in module.named_children():
            remaining += visit(child_name, child, leaf)
        if module is root or inside_leaf_unit or not _has_forward(module):
            return remaining
        by_size = config.wrap_min_numel > 0 and remaining >= config.wrap_min_numel
        if remaining > 0 and (id(module) in by_class or class_matches(module, names) or by_size):
            chosen.add(id(module))
            return 0
        return remaining

    visit("", root, inside_leaf_unit=False)
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
            # The name state_dict() gives: Note [checkpoint wrappers keep the names]
            fqn = state_dict_name(f"{module_name}.{param_name}" if module_name else param_name)
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
