"""``fedpose data synth``: generate the synthetic federated pose dataset."""

from __future__ import annotations

import argparse

from fedpose.cli.common import UserError, examples, print_json


def register(subparsers: argparse._SubParsersAction) -> None:
    data = subparsers.add_parser("data", help="create and inspect datasets")
    data_sub = data.add_subparsers(dest="data_command", metavar="DATA_COMMAND", required=True)

    synth = data_sub.add_parser(
        "synth",
        help="generate the synthetic dataset (public/, site-1..N/, test/)",
        description=(
            "Render articulated synthetic people in MPII annotation format: a public split, one "
            "split per site (each with its own pose mix, backgrounds, lighting and camera), and a "
            "test split mixing all sites. Writes preview.png, public_view_demo.png and manifest.json."
        ),
    )
    synth.add_argument("--out", required=True, help="output directory (must be empty unless --overwrite/--resume)")
    synth.add_argument("--sites", type=int, default=3, help="number of sites (default 3)")
    synth.add_argument("--per-site", type=int, default=500, help="images per site (default 500)")
    synth.add_argument("--public", type=int, default=1000, help="images in the public split (default 1000)")
    synth.add_argument("--test", type=int, default=500, help="images in the test split (default 500)")
    synth.add_argument("--size", default="256x192", help="image HEIGHTxWIDTH in pixels (default 256x192)")
    synth.add_argument("--seed", type=int, default=0, help="dataset seed (default 0)")
    synth.add_argument("--workers", type=int, default=2, help="rendering processes (default 2)")
    synth.add_argument("--overwrite", action="store_true", help="replace a previous dataset in --out")
    synth.add_argument("--resume", action="store_true", help="continue an interrupted run with the same parameters")
    synth.add_argument("--quiet", action="store_true", help="no progress bar")
    synth.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    synth.epilog = examples(
        'fedpose data synth --out data/synth --sites 3 --per-site 500',
        'fedpose data synth --out data/tiny --sites 1 --per-site 8 --public 8 --test 4 --size 64x64',
    )
    synth.set_defaults(handler=run_synth)


def run_synth(args: argparse.Namespace) -> int:
    from fedpose.data.synthetic import SyntheticDataError, generate_dataset, parse_size

    if args.workers < 1:
        raise UserError(f"--workers must be at least 1, got {args.workers}")
    if args.overwrite and args.resume:
        raise UserError("--overwrite and --resume are mutually exclusive")
    try:
        size = parse_size(args.size)
        manifest = generate_dataset(
            args.out, sites=args.sites, per_site=args.per_site, public=args.public, test=args.test,
            size=size, seed=args.seed, workers=args.workers, overwrite=args.overwrite,
            resume=args.resume, progress=not args.quiet,
        )
    except SyntheticDataError as exc:
        raise UserError(str(exc)) from None
    summary = {
        "out": str(args.out),
        "splits": {name: split["images"] for name, split in manifest["splits"].items()},
        "size": manifest["params"]["size"],
        "seed": manifest["params"]["seed"],
        "sites": {name: split["description"] for name, split in manifest["splits"].items()},
    }
    if args.json:
        print_json(summary)
        return 0
    height, width = summary["size"]
    print(f"synthetic dataset in {args.out} ({height}x{width} images, seed {summary['seed']}):")
    for name, images in summary["splits"].items():
        description = summary["sites"][name].removeprefix(f"{name}: ")
        print(f"  {name}: {images} image{'' if images == 1 else 's'} — {description}")
    return 0
