"""The drafter a plan's speculative section asks for, built for the executor."""
from __future__ import annotations

from pathlib import Path

from executor.model.llama import LlamaModel
from executor.model.sampling import SamplingParams
from executor.speculative.ngram import PromptLookup
from sim.config.errors import ConfigError
from sim.config.plan import Plan
from sim.config.scenario import HEAD_METHODS


def drafter_dir(plan: Plan, named_only: bool = False) -> Path | None:
    """The folder of a draft_model scenario's draft, a medusa scenario's heads or an eagle (mtp) scenario's head
    (the scenario's, relative to it, or the default); a one-line error if there is none. `named_only`: None unless
    the scenario names a folder that holds them (which is then checked as ever)."""
    from executor.speculative.draft_model import default_draft_dir
    from executor.speculative.eagle import default_eagle_dir
    from executor.speculative.medusa import default_medusa_dir

    spec = plan.speculative
    if spec.method == "medusa":
        name, default, meta, key, cmd = (spec.medusa_heads, default_medusa_dir(), "medusa.json",
                                         "speculative.medusa_heads", "train Medusa heads with `infersim train-medusa")
    elif spec.method in HEAD_METHODS:
        name, default, meta, key, cmd = (spec.eagle_head, default_eagle_dir(), "eagle.json", "speculative.eagle_head",
                                         "train an EAGLE head with `infersim train-eagle")
    else:
        name, default, meta, key, cmd = (spec.draft_model, default_draft_dir(), "draft.json",
                                         "speculative.draft_model", "make a draft model with `infersim distill")
    folder = default if name is None else (plan.base_dir / Path(name).expanduser())
    if named_only and (name is None or not (folder / meta).is_file()):
        return None
    if not (folder / meta).is_file():
        raise ConfigError(f"nothing in {folder}; {cmd} --out {folder}`", key)
    _check_saved(folder, meta, plan, key, cmd)
    return folder


def _check_saved(folder: Path, meta: str, plan: Plan, key: str, cmd: str) -> None:
    """What the folder's meta file says fits the scenario: its weights beside it, the target's hidden size and, for
    Medusa, a head for every depth of the tree; read before the target model loads (a mismatch used to surface
    after it, as a KeyError or a traceback)."""
    import json

    weights = folder / meta.replace(".json", ".safetensors")
    try:
        data = json.loads((folder / meta).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ConfigError(f"{folder / meta} is not readable JSON ({type(e).__name__}); {cmd} --out {folder}`",
                          key) from None
    counts = ("num_heads", "hidden_size") if meta == "medusa.json" else ("num_layers", "hidden_size")
    if meta == "eagle.json" and isinstance(data, dict) and not isinstance(data.get("vocab"), list):
        raise ConfigError(f"{folder / meta} has no vocab (a list of token ids); {cmd} --out {folder}`", key)
    if not isinstance(data, dict) or any(not isinstance(data.get(k), int) or isinstance(data.get(k), bool)
                                         or data[k] < 1 for k in counts):
        raise ConfigError(f"{folder / meta} has no {' and '.join(counts)} (whole numbers); {cmd} --out {folder}`", key)
    if not weights.is_file():
        raise ConfigError(f"{folder} has {meta} but no {weights.name}; {cmd} --out {folder}`", key)
    if data["hidden_size"] != plan.model.hidden_size:
        raise ConfigError(f"{folder} was made for a target of hidden size {data['hidden_size']}, not "
                          f"{plan.model.name}'s {plan.model.hidden_size}; {cmd} --out DIR` for this model", key)
    depth = max((len(p) for p in plan.speculative.medusa_tree or ()), default=0) if meta == "medusa.json" else 0
    if depth > data.get("num_heads", 0):
        raise ConfigError(f"a tree {depth} deep, but the heads in {folder} are {data['num_heads']} (one per depth); "
                          f"allowed: paths of at most {data['num_heads']} ranks, or heads trained with `infersim "
                          f"train-medusa --heads {depth}`", "speculative.medusa_tree")


def make_drafter(plan: Plan, target: LlamaModel, sampling: SamplingParams):
    """The scenario's drafter for speculative decoding, or None."""
    spec = plan.speculative
    if spec is None:
        return None
    if spec.method == "draft_model":
        from executor.speculative.draft_model import DraftModelDrafter, load_draft

        try:
            draft = load_draft(drafter_dir(plan), target)
        except ValueError as e:
            raise ConfigError(str(e), "speculative.draft_model") from None
        return DraftModelDrafter(draft, sampling, num_blocks=max(16, plan.num_blocks // 4),
                                 max_num_seqs=plan.scheduler.max_num_seqs, max_model_len=plan.scheduler.max_model_len,
                                 use_graphs=None if plan.executor.cuda_graphs else False)
    if spec.method == "medusa":
        from executor.speculative.medusa import MedusaDrafter, load_medusa

        try:
            heads = load_medusa(drafter_dir(plan), target)
        except ValueError as e:
            raise ConfigError(str(e), "speculative.medusa_heads") from None
        try:  # the tree must fit these heads: no deeper than there are heads
            return MedusaDrafter(heads, [tuple(p) for p in spec.medusa_tree])
        except ValueError as e:
            raise ConfigError(f"{e} (the heads in {drafter_dir(plan)} are {heads.num_heads})",
                              "speculative.medusa_tree") from None
    if spec.method in HEAD_METHODS:  # mtp: no model the executor runs carries MTP layers, the EAGLE head stands in
        from executor.speculative.eagle import EagleDrafter, load_eagle

        try:
            head = load_eagle(drafter_dir(plan), target)
        except ValueError as e:
            raise ConfigError(str(e), "speculative.eagle_head") from None
        return EagleDrafter(head, spec.candidate_tree, num_blocks=max(16, plan.num_blocks // 4))
    return PromptLookup(spec.prompt_lookup_max, spec.prompt_lookup_min)
