from .fedevalfair_handlers import FedEvalFairHolder as FedEvalFairHolder
from .fedevalfair_handlers import HolderRows as HolderRows
from .fedevalfair_handlers import fedevalfair_handlers as fedevalfair_handlers
from .fpfl_data import FPFLShard as FPFLShard
from .fpfl_handlers import fpfl_handlers as fpfl_handlers
from .fpfl_node import FPFLNodeSettings as FPFLNodeSettings
from .ldp import LocalUsers as LocalUsers
from .ldp import ldp_audit_handler as ldp_audit_handler
