"""The main job: train a small byte-level language model once per positional encoding at one length and
evaluate it at 1x-16x that length. A thin entry point; the study lives in posenc.study (ops/study.py).

    python scripts/study.py [--preset default|quick|large] [--out build/study] [--data FILE] ...
    torchrun --standalone --nproc_per_node 2 scripts/study.py ...
"""
from posenc.study import main

if __name__ == "__main__":
    main()
