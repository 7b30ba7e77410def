"""The run's configuration: the typed schema (`schema`), reading it from YAML, DeepSpeed JSON
and flags (`load`, `deepspeed`, `aliases`, `values`), `--help` and `docs/flags.md`
(`reference`), the flags tools share (`tool_flags`), and the rules that span sections
(`checks`). Nothing is imported here, so importing one config module stays cheap."""
