"""What the user asks for: the typed run config (``schema``) and how a YAML file with dotted overrides becomes
one (``loading``). Every bad value is a ``ConfigError`` naming its key path."""

from hybridrl.config.loading import apply_overrides, load_config, parse_override
from hybridrl.config.schema import (
                                    ActorConfig,
                                    AlgorithmConfig,
                                    ClusterConfig,
                                    ConfigError,
                                    CriticConfig,
                                    DataConfig,
                                    EnvironmentConfig,
                                    KLConfig,
                                    ModelConfig,
                                    PoolConfig,
                                    RefConfig,
                                    RewardConfig,
                                    RewardModelConfig,
                                    RoleBase,
                                    RolesConfig,
                                    RolloutConfig,
                                    RunConfig,
                                    TinyModelConfig,
                                    TrainerConfig,
)

__all__ = ["ActorConfig", "AlgorithmConfig", "ClusterConfig", "ConfigError", "CriticConfig", "DataConfig",
           "EnvironmentConfig", "KLConfig",
           "ModelConfig", "PoolConfig", "RefConfig", "RewardConfig", "RewardModelConfig", "RoleBase", "RolesConfig",
           "RolloutConfig", "RunConfig", "TinyModelConfig", "TrainerConfig", "apply_overrides", "load_config",
           "parse_override"]
