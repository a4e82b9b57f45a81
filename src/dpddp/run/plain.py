"""The config's groups: its sections that are groups, and the groups of presets."""

GROUPS = ("data", "model", "trainer", "logger", "callbacks")  # the config's sections that are groups
PRESETS = ("experiment", "debug", "hparams_search")  # the groups of presets, merged at the top level
