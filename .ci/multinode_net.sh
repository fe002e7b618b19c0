# The two-node test cluster's names and addresses (sourced by .ci/multinode_up.sh and .ci/multinode_down.sh).
# Two networks, as on real clusters: the cluster fabric (10.77.0.0/24: the nodes' names resolve here; Ray, the
# trainer's stores, the engines and the weight broadcast use it) and a site network (10.78.0.0/24) that the nodes
# share with an outsider host, which has no way onto the fabric.
MN_HOSTS=(mnode1 mnode2 mout)
MN_FABRIC=(10.77.0.1 10.77.0.2 "")
MN_SITE=(10.78.0.1 10.78.0.2 10.78.0.9)
MN_SWITCH=mn_switch
