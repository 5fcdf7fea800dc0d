from twisted.application.service import ServiceMaker

iop_node = ServiceMaker("iop Node", "iop.node.tap", "A Node: dials the Edge and runs LLM back ends.", "iop-node")
