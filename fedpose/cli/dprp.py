"""``fedpose dprp``: Video-DPRP, (ε, δ)-DP per clip w.r.t. one frame.

    fedpose dprp clip.npy --out private.npy --epsilon 1000 --delta 1e-5 --proj-dim 256
    fedpose dprp frames/ --out private_frames/ --epsilon 1000 --delta 1e-5 --proj-dim 256 --split 0.5

INPUT is a directory of frame images (sorted by name, all the same size) or a ``.npy`` array
F×H×W×3 (uint8 0–255, or floats in [0, 1]). OUT ending in ``.npy`` receives a float32 array in
[0, 1]; any other OUT is a directory that receives ``frame_00000.png`` …
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

from fedpose.cli.common import IMAGE_SUFFIXES, UserError, examples, open_unit_interval, positive_float, positive_int


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("dprp", help="Video-DPRP: (ε, δ)-DP reconstruction of a video clip (per frame)")
    parser.add_argument("input", metavar="INPUT", help="directory of frames, or a .npy array F×H×W×3")
    parser.add_argument("--out", required=True, help="output .npy file, or a directory for PNG frames")
    parser.add_argument("--epsilon", type=positive_float, required=True, help="total ε for the clip")
    parser.add_argument("--delta", type=open_unit_interval, required=True, help="total δ for the clip")
    parser.add_argument("--proj-dim", type=positive_int, required=True, help="JL projection dimension k")
    parser.add_argument("--split", type=open_unit_interval, default=0.5, help="fraction of (ε, δ) for the projection")
    parser.add_argument("--rank", type=positive_int, default=None, help="singular vectors kept (default min(F, k))")
    parser.add_argument("--insecure-seed", type=int, default=None,
                        help="TESTS ONLY: seeded P and noise, NOT PRIVATE (the seed regenerates the noise); "
                        "default: CSPRNG (AES-256-CTR keyed from os.urandom)")
    parser.epilog = examples(
        'fedpose dprp clip.npy --out private.npy --epsilon 4 --delta 1e-5 --proj-dim 64',
        'fedpose dprp frames/ --out private_frames/ --epsilon 4 --delta 1e-5 --proj-dim 64',
    )
    parser.set_defaults(handler=_run)


def load_clip(path: Path):
    """F×H×W×3 float64 in [0, 1] from a .npy file or a directory of frames."""
    import numpy as np

    from fedpose.privacy.input_privacy import InputPrivacyError, load_rgb

    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise UserError(f"{path}: no frame images found")
        try:
            frames = [load_rgb(p) for p in files]
        except InputPrivacyError as exc:
            raise UserError(str(exc)) from exc
        shapes = {f.shape for f in frames}
        if len(shapes) != 1:
            raise UserError(f"{path}: frames have different sizes {sorted(shapes)}")
        return np.stack(frames).astype(np.float64) / 255.0
    if not path.exists():
        raise UserError(f"{path}: no such file or directory")
    try:
        clip = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:  # EOFError: an empty or truncated file
        # not numpy's text for pickled data: it advises loading the file unsafely
        reason = "it holds pickled objects, which are never loaded" if "pickle" in str(exc) else " ".join(str(exc).split())
        raise UserError(f"{path}: not a readable .npy array ({reason})") from exc
    if clip.ndim != 4 or clip.shape[-1] != 3:
        raise UserError(f"{path}: expected an array F×H×W×3, got shape {clip.shape}")
    if clip.dtype == np.uint8:
        return clip.astype(np.float64) / 255.0
    return clip.astype(np.float64)


def _run(args: argparse.Namespace) -> int:
    import numpy as np

    from fedpose.io import atomic_write
    from fedpose.privacy.csprng import SEEDED_NO_GUARANTEE
    from fedpose.privacy.dprp import DprpError, video_dprp
    from fedpose.viz import save_png
    from fedpose.privacy.ldp_slicing import to_uint8

    clip = load_clip(Path(args.input))
    try:
        result = video_dprp(
            clip, args.epsilon, args.delta, args.proj_dim, split=args.split, rank=args.rank,
            insecure_seed=args.insecure_seed,
        )
    except DprpError as exc:
        raise UserError(str(exc)) from exc
    out = Path(args.out)
    if out.suffix.lower() == ".npy":
        buffer = io.BytesIO()
        np.save(buffer, result.frames)
        atomic_write(out, lambda fh: fh.write(buffer.getvalue()))
    else:
        for index, frame in enumerate(result.frames):
            save_png(to_uint8(frame * 255.0), out / f"frame_{index:05d}.png")
    g = result.guarantee
    void = f"{SEEDED_NO_GUARANTEE}: " if g["guarantee_void"] else ""
    print(
        f"wrote {len(result.frames)} frame(s) to {out}; {void}ε = {g['epsilon']:g} (DP, δ = {g['delta']:.3g}, "
        f"basic composition), unit: one frame of the clip, replace-one-frame adjacency; σ_projection = {g['sigma_projection']:.4g}, "
        f"σ_covariance = {g['sigma_covariance']:.4g} ({g['covariance_calibration']}); randomness: {g['randomness']}",
        file=sys.stdout,
    )
    return 0
