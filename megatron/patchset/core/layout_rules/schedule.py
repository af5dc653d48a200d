"""The training schedule: megatron-core 0.19.2's late failures of evaluation and LR warm-up."""

from __future__ import annotations

from megatron.patchset.core.rules import rule


@rule("eval-interval-set", phase="layout", flags=("--eval-interval", "--train-iters"))
def _eval_interval_set(args):
    """megatron 0.19.2 divides --train-iters by --eval-interval when sizing the validation set,
    even with --eval-iters 0; without it every rank fails after the model is built."""
    if (
        args.train_iters
        and args.eval_interval is None
        and not args.full_validation
        and not args.skip_train
    ):
        return (
            "--eval-interval is not set: megatron-core 0.19.2 needs it with --train-iters (it "
            "sizes the validation set from it even with --eval-iters 0). Set e.g. --eval-interval "
            "1000."
        )
    return None


@rule(
    "lr-warmup-shorter-than-decay",
    phase="layout",
    flags=("--lr-warmup-iters", "--lr-decay-iters", "--train-iters"),
)
def _lr_warmup_shorter_than_decay(args):
    """megatron's LR scheduler asserts warm-up < decay (decay defaults to --train-iters)."""
    if not args.train_iters or args.lr_warmup_fraction is not None:
        return None
    decay = args.lr_decay_iters or args.train_iters
    if args.lr_warmup_iters >= decay:
        source = "--lr-decay-iters" if args.lr_decay_iters else "--train-iters"
        return (
            f"--lr-warmup-iters {args.lr_warmup_iters} is not shorter than the decay length "
            f"{decay} ({source}); megatron's scheduler refuses it after the model is built. "
            "Shorten the warm-up or lengthen the run."
        )
    return None


@rule("save-needs-save-interval", phase="layout", flags=("--save", "--save-interval"))
def _save_needs_save_interval(args):
    """megatron asserts (without a message) that --save comes with --save-interval."""
    if getattr(args, "save", None) and getattr(args, "save_interval", None) is None:
        return (
            f"--save {args.save} needs --save-interval N (megatron also saves at --exit-interval "
            "and at the end of training); to only load, drop --save."
        )
    return None
