"""The resolved config as TensorBoard hparams: flattening rules, and a written record that
TensorBoard's hparams plugin parses back to the same values."""

from tensorboard.backend.event_processing import event_accumulator
from tensorboard.plugins.hparams import metadata
from torch.utils.tensorboard import SummaryWriter

from megazpp.analysis.hparams import hparams_from_config, write_hparams
from megazpp.config.schema import Config


def test_flattening_rules():
    cfg = {
        "model": {"hidden_size": 64, "tie_embeddings": False, "norm_eps": 1e-5},
        "data": {"data_path": ["0.7", "A", "0.3", "B"], "tokenizer_model": None},
        "zero": {"paro_strategy": "IGG", "nested": {"depth": 2}},
    }
    assert hparams_from_config(cfg) == {
        "model.hidden_size": 64,
        "model.tie_embeddings": False,
        "model.norm_eps": 1e-5,
        "data.data_path": '["0.7", "A", "0.3", "B"]',
        "zero.paro_strategy": "IGG",
        "zero.nested.depth": 2,
    }


def test_written_hparams_read_back_by_the_plugin(tmp_path):
    cfg = Config().to_dict()
    cfg["zero"]["paro_strategy"] = "IGG"
    with SummaryWriter(log_dir=str(tmp_path)) as writer:
        write_hparams(writer, cfg)
        writer.add_scalar("train/loss", 1.5, 1)
    acc = event_accumulator.EventAccumulator(str(tmp_path))
    acc.Reload()
    content = acc.PluginTagToContent(metadata.PLUGIN_NAME)
    assert list(content) == [metadata.SESSION_START_INFO_TAG]  # no per-run experiment record
    info = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
    hp = info.hparams
    assert hp["model.hidden_size"].number_value == cfg["model"]["hidden_size"]
    assert hp["precision.bf16"].WhichOneof("kind") == "bool_value" and hp["precision.bf16"].bool_value is False
    assert hp["zero.paro_strategy"].string_value == "IGG"
    assert "data.tokenizer_model" not in hp  # None: unset, left out
    assert set(hp) == set(hparams_from_config(cfg))
