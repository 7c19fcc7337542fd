"""plugins: editor/tool integrations and plugin hook specs."""
