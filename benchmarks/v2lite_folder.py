"""A model folder of DeepSeek-V2-Lite shapes (benchmarks/configs/deepseek-v2-lite) with the
built-in tiny model's 1,000-token vocabulary and tokenizer, so that its tokenizer decodes every
token; weights are drawn at load (load_format=dummy). Issue 28's serving runs use it.

    python benchmarks/v2lite_folder.py /tmp/v2lite-1k
"""

import json
import pathlib
import shutil
import sys

from rayinfer.engine.model_source import resolve_model_path


def main(out: str) -> None:
    tiny, folder = resolve_model_path("tiny"), pathlib.Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    configs = pathlib.Path(__file__).parent / "configs"
    config = json.loads((configs / "deepseek-v2-lite" / "config.json").read_text())
    config["vocab_size"] = 1000
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, folder / name)


if __name__ == "__main__":
    main(sys.argv[1])
