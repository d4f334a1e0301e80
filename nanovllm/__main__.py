import sys

from nanovllm.cli import main
from nanovllm.program import quiet_ctrl_c, refuse_shadowed_package

quiet_ctrl_c()
refuse_shadowed_package()
sys.exit(main())
