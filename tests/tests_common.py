WORLD_SIZES = [1, 2, 3, 4]

# torch.optim.AdamW's keyword for each implementation the planner names (plan.memory.ADAMW)
ADAMW_OPTIONS = {"fused": {"fused": True}, "foreach": {"foreach": True},
                 "for-loop": {"foreach": False}}
