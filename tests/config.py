"""The package's Hydra config (`asyncfp8/conf`), composed in the test's own process as the
launcher composes it: for tests that check a config, or build a learner from one,
without starting a process."""


def compose(*overrides: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    with initialize_config_module(version_base="1.3", config_module="asyncfp8.conf"):
        return hydra_compose("config", overrides=list(overrides))
