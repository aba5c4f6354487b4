"""ML-Forgetting (thesis Ch. 6): the Mixed-Linear model, exact Newton forgetting steps, the request ledger."""
from scrubnet.mlforget.model import (MLConfig, MLState, build_ml_model, check_forget_ids, choose_core_ids,
                                     forget_all, forget_request, remaining_information_bound,
                                     remaining_information_nats, retrain_user_weights)
from scrubnet.mlforget.dual import DualFactor, dual_fit
from scrubnet.mlforget.primal import PrimalFactor, primal_fit
from scrubnet.mlforget.user import ml_from_network
from scrubnet.mlforget.objective import UserObjective
from scrubnet.mlforget.solve import SGDTrainConfig, SolverConfig, newton_step

__all__ = ["MLConfig", "MLState", "build_ml_model", "check_forget_ids", "choose_core_ids", "forget_all",
           "forget_request", "remaining_information_bound", "remaining_information_nats",
           "DualFactor", "dual_fit", "PrimalFactor", "primal_fit", "ml_from_network", "retrain_user_weights", "UserObjective",
           "SGDTrainConfig", "SolverConfig", "newton_step"]
