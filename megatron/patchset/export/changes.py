"""An upstream change: the edits of one pull request and the commit message that explains them.

A change is what ``python -m megatron.patchset export --series`` writes as one patch: its edits
to upstream's code and to upstream's tests (:mod:`.edits`), and a commit message with the
motivation, the design, the measured figures and the test plan. Changes are declared where their
code lives and listed in order in :data:`SERIES`; each later change may assume the earlier ones.
"""

from __future__ import annotations

import dataclasses
import importlib
import textwrap

from megatron.patchset.core.errors import PatchsetError

WIDTH = 72  # git's commit-message convention


@dataclasses.dataclass(frozen=True)
class UpstreamChange:
    """One pull request's worth of edits.

    Attributes:
        name: the change's name on the command line (``--feature``) and in the patch file name.
        subject: the commit subject, in upstream's style (``area: what changes``).
        motivation: what fails or costs today, and where.
        design: what the edit does and why this way.
        figures: measured results (device, versions, command), or what was not measured.
        test_plan: the commands a reviewer runs.
        edits: edits of upstream's code, then of upstream's tests.
        needs: the names of earlier changes of the series whose code this one's edits build on;
            the series refuses it unless each is applied before it or already in the checkout.
    """

    name: str
    subject: str
    motivation: str
    design: str
    figures: str
    test_plan: str
    edits: tuple
    needs: tuple[str, ...] = ()

    def message(self) -> str:
        """The commit message: subject, blank line, then the sections wrapped at 72 columns."""
        parts = [self.subject, ""]
        for title, text in (
            ("Motivation", self.motivation),
            ("Design", self.design),
            ("Measured", self.figures),
            ("Test plan", self.test_plan),
        ):
            parts += [f"{title}:", _wrap(text), ""]
        return "\n".join(parts).rstrip() + "\n"

    def paths(self) -> list[str]:
        """The files the change edits, in the order of its edits."""
        return list(dict.fromkeys(edit.path for edit in self.edits))


def _wrap(text: str) -> str:
    """Paragraphs re-wrapped at :data:`WIDTH`; lines starting with ``$ `` or ``- `` kept."""
    out = []
    for paragraph in textwrap.dedent(text).strip().split("\n\n"):
        lines = paragraph.splitlines()
        if all(line.startswith(("$ ", "- ", "  ")) for line in lines):
            out.append("\n".join(lines))
        else:
            out.append(textwrap.fill(" ".join(line.strip() for line in lines), WIDTH))
    return "\n\n".join(out)


# module:attribute of each change, in the order a series applies them
SERIES = (
    "megatron.patchset.core.compat:HELP_PERCENT_CHANGE",
    "megatron.patchset.features.triton_cross_entropy.upstream:CHANGE",
    "megatron.patchset.features.torch_adam.upstream:CHANGE",
    "megatron.patchset.features.torch_adam.upstream:CLIP_CHANGE",
    "megatron.patchset.core.compat:CHECKPOINT_EXIT_CHANGE",
    "megatron.patchset.features.fsdp_cuda_graphs.upstream:CHANGE",
    "megatron.patchset.features.grouped_mm.upstream:CHANGE",
    "megatron.patchset.features.dp_grad_scaling.upstream:CHANGE",
    "megatron.patchset.features.triton_swiglu.upstream:CHANGE",
)


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A feature the series cannot hold, and why (the upstream difference that blocks it)."""

    name: str
    reason: str
    short: str  # one line for ``--list``


# module:attribute of each Refusal: named with --series --feature, refused with its reason
REFUSALS = ("megatron.patchset.features.p2p_overlap.upstream:REFUSAL",)


def _load(spec: str):
    module, _, attribute = spec.partition(":")
    return getattr(importlib.import_module(module), attribute)


def refusals() -> dict[str, Refusal]:
    """``{feature name: why it is not in the series}``."""
    return {refusal.name: refusal for refusal in map(_load, REFUSALS)}


def series() -> list[UpstreamChange]:
    return [_load(spec) for spec in SERIES]


def select(names: list[str] | None) -> list[UpstreamChange]:
    """The changes named (all by default), in series order; an unknown name is refused with the
    known ones."""
    changes = series()
    if not names:
        return changes
    known = {change.name: change for change in changes}
    unknown = [name for name in names if name not in known]
    refused = refusals()
    blocked = [name for name in unknown if name in refused]
    if blocked:
        raise PatchsetError(
            "; ".join(
                f"{name}: not in the patch series: {refused[name].reason}" for name in blocked
            )
        )
    if unknown:
        from megatron.patchset.core import features

        loaded = {f.name: f for f in features.load()}
        why = "".join(
            f"{name}: {loaded[name].upstream_pr}, not sent upstream; "
            if not loaded[name].upstream_pr.exportable
            else f"{name}: a feature not yet declared as edits of upstream functions; "
            for name in unknown
            if name in loaded
        )
        raise PatchsetError(
            f"{why}no upstream change named {', '.join(unknown)}; the series holds: "
            + ", ".join(known)
        )
    return [change for change in changes if change.name in names]
