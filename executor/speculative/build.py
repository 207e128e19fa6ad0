"""The drafter a plan's speculative section asks for, built for the executor."""
from __future__ import annotations

from pathlib import Path

from executor.model import LlamaModel
from executor.sampling import SamplingParams
from executor.speculative.ngram import PromptLookup
from sim.config.errors import ConfigError
from sim.config.plan import Plan


def drafter_dir(plan: Plan) -> Path:
    """The folder of a draft_model scenario's draft or a medusa scenario's heads (the scenario's, relative to
    it, or the default); a one-line error if there is none."""
    from executor.speculative.training import default_draft_dir, default_medusa_dir

    spec = plan.speculative
    if spec.method == "medusa":
        name, default, meta, key, cmd = (spec.medusa_heads, default_medusa_dir(), "medusa.json",
                                         "speculative.medusa_heads", "train Medusa heads with `infersim train-medusa")
    else:
        name, default, meta, key, cmd = (spec.draft_model, default_draft_dir(), "draft.json",
                                         "speculative.draft_model", "make a draft model with `infersim distill")
    folder = default if name is None else (plan.base_dir / Path(name).expanduser())
    if not (folder / meta).is_file():
        raise ConfigError(f"nothing in {folder}; {cmd} --out {folder}`", key)
    return folder


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
                                 max_num_seqs=plan.scheduler.max_num_seqs, max_model_len=plan.max_model_len,
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
    return PromptLookup(spec.prompt_lookup_max, spec.prompt_lookup_min)
