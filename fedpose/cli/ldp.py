"""``fedpose ldp``: LDP-Slicing budgets and image privatization.

    fedpose ldp allocate --epsilon 20 --json
    fedpose ldp slice photos/ extra.png --out private/ --epsilon 20 [--no-ll-prune]
        [--ll-offset 128] [--allocation sqrt|uniform] [--insecure-seed S] [--format png|npy]

``slice`` writes ``OUT/<stem>.png`` (the privatized image in RGB) or, with ``--format npy``,
``OUT/<stem>.npy``: the privatized YCbCr uint8 array (H×W×3) as released by the randomized
response, before the conversion back to RGB. An image that cannot be decoded is skipped; the other
outputs are written normally, then one line on stderr names every skipped input and the exit code is 2.
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

from fedpose.cli.common import UserError, collect_images, examples, positive_float, print_json

def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("ldp", help="LDP-Slicing: pixel-wise ε-LDP images (budget allocation, privatize)")
    sub = parser.add_subparsers(dest="ldp_command", metavar="ACTION", required=True)

    allocate = sub.add_parser("allocate", help="per-bit-plane budgets ε_{c,b} for an ε_total")
    allocate.add_argument("--epsilon", type=positive_float, required=True, help="ε_total per pixel")
    allocate.add_argument("--allocation", choices=("sqrt", "uniform"), default="sqrt",
                          help="sqrt: ε_{c,b} ∝ √(w_c w_b), more budget to luma and high bits (default); uniform: equal")
    allocate.add_argument("--json", action="store_true", help="print one JSON object only")
    allocate.epilog = examples(
        'fedpose ldp allocate --epsilon 20',
        'fedpose ldp allocate --epsilon 20 --allocation uniform --json',
    )
    allocate.set_defaults(handler=_allocate)

    slice_ = sub.add_parser("slice", help="privatize images (files or directories, walked recursively)")
    slice_.add_argument("inputs", nargs="+", metavar="INPUT", help="image files or directories")
    slice_.add_argument("--out", required=True, help="output directory")
    slice_.add_argument("--epsilon", type=positive_float, required=True, help="ε_total per (masked) pixel")
    slice_.add_argument("--no-ll-prune", dest="ll_prune", action="store_false",
                        help="skip the Haar LL pruning: release the whole image, not only its edges and detail")
    slice_.add_argument("--ll-offset", type=float, default=0.0,
                        help="added after LL pruning, before the clamp (128 keeps negative details; default 0)")
    slice_.add_argument("--allocation", choices=("sqrt", "uniform"), default="sqrt",
                        help="how ε_total is split over the bit planes (see `fedpose ldp allocate`; default sqrt)")
    slice_.add_argument("--insecure-seed", type=int, default=None,
                        help="TESTS ONLY: seeded PCG64, NOT PRIVATE (the seed undoes the flips); default: CSPRNG")
    slice_.add_argument("--format", choices=("png", "npy"), default="png",
                        help="png: the privatized image in RGB (default); npy: the released YCbCr uint8 array")
    slice_.epilog = examples(
        'fedpose ldp slice photos/ --out private/ --epsilon 20',
        'fedpose ldp slice a.png --out private/ --epsilon 20 --no-ll-prune --ll-offset 128',
    )
    slice_.set_defaults(handler=_slice)


def _allocate(args: argparse.Namespace) -> int:
    from fedpose.privacy.ldp_slicing import allocate_budget, budgets_as_dict
    from fedpose.privacy.report import ldp_adjacency

    budgets = budgets_as_dict(allocate_budget(args.epsilon, args.allocation))
    adjacency = ldp_adjacency(per_block=False)  # the budgets are per privatized pixel
    if args.json:  # ε_total with its qualifiers, as everywhere an ε is printed
        print_json({"epsilon_total": args.epsilon, "guarantee": "LDP", "delta": 0.0, "unit": "pixel",
                    "accountant": "pure composition", "adjacency": adjacency, "budgets": budgets})
        return 0
    print(f"LDP-Slicing budgets, ε_total = {args.epsilon:g} (LDP, δ = 0, pure composition) per pixel, {adjacency}; "
          f"allocation {args.allocation}")
    print("bit:    " + " ".join(f"{b:>7}" for b in range(1, 9)) + "   (1 = least significant)")
    for channel, values in budgets.items():
        print(f"{channel:<7} " + " ".join(f"{v:7.4f}" for v in values))
    return 0


def what_is_kept(ll_prune: bool, ll_offset: float) -> str:
    """What survives in the output, and how to keep more: LL pruning (the default) releases detail only."""
    if not ll_prune:
        return ("the whole image (--no-ll-prune): brightness, colour and detail, every bit plane flipped at its "
                "budget; the guarantee holds per original pixel")
    kept = ("each 2×2 block's average (the picture's brightness and colour) is zeroed before the flips (LL pruning, "
            "the default, no budget spent), so only edges and fine detail are released")
    if ll_offset == 0:
        return (kept + ", and negative detail is clamped to 0: at moderate ε the result looks like static. Keep more "
                "with --ll-offset 128 (negative detail too) or --no-ll-prune (the whole image)")
    return kept + f", shifted by --ll-offset {ll_offset:g} so negative detail survives; --no-ll-prune keeps the whole image"


def _slice(args: argparse.Namespace) -> int:
    import numpy as np
    from fedpose.progress import progress_bar
    from fedpose.io import atomic_write
    from fedpose.privacy.input_privacy import InputPrivacyError, load_rgb
    from fedpose.viz import save_png
    from fedpose.privacy.ldp_slicing import LdpSlicer, LdpSlicingError

    out_dir = Path(args.out)
    images = collect_images(args.inputs, exclude=out_dir)
    try:
        slicer = LdpSlicer(
            args.epsilon, ll_prune=args.ll_prune, ll_offset=args.ll_offset, allocation=args.allocation,
            insecure_seed=args.insecure_seed,
        )
    except LdpSlicingError as exc:
        raise UserError(str(exc)) from exc
    failed: list[str] = []  # reported once, at the end, in one line
    bar = progress_bar(len(images), "ldp slice", unit="img", disable=len(images) < 20)
    for path in images:
        bar.update(1)
        try:
            result = slicer(load_rgb(path))
        except InputPrivacyError as exc:
            failed.append(" ".join(str(exc).split()))
            continue
        # privatized images are made to be handed on: the umask's mode, not owner-only
        if args.format == "png":
            save_png(result.rgb, out_dir / f"{path.stem}.png", shared=True)
        else:
            buffer = io.BytesIO()
            np.save(buffer, result.ycbcr)
            atomic_write(out_dir / f"{path.stem}.npy", lambda fh: fh.write(buffer.getvalue()), shared=True)
    bar.close()
    guarantee = slicer.guarantee()
    written = len(images) - len(failed)
    print(f"wrote {written} {'image' if written == 1 else 'images'} to {out_dir} ({args.format})")
    print(f"  guarantee: {guarantee['guarantee_statement']}; δ = 0")
    print(f"  unit: {guarantee['block_note']}; {guarantee['adjacency']}")
    print(f"  kept: {what_is_kept(args.ll_prune, args.ll_offset)}")
    print(f"  randomness: {guarantee['randomness']}")
    if failed:
        others = f"the other {written} were written" if written else "nothing was written"
        raise UserError(f"{len(failed)} of {len(images)} input(s) could not be decoded and were skipped ({others}): "
                        f"{'; '.join(failed)}")
    return 0
