"""The run's configuration: the typed schema (`schema`), reading it from YAML, DeepSpeed JSON
and flags (`load`, `deepspeed`, `aliases`, `values`), `--help` and `docs/flags.md`
(`reference`), the flags tools share (`tool_flags`), the sections mapped onto each subsystem's
own checked options (`options`), and the rules that span sections, where those options are
built once before any rank starts (`checks`). Nothing is imported here, so importing one config
module stays cheap."""
