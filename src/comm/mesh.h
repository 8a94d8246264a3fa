#pragma once
// DeviceMesh: the ranks of a job laid out as pipeline x data x tensor, tensor innermost
// (as Megatron places them): rank = p*(D*T) + d*T + t, so a tensor-parallel group is T
// consecutive ranks (one node's GPUs when T divides the GPUs per node), a data-parallel
// group strides by T, a pipeline group by D*T.
//
// Everything here is a pure function of the shape, except split_mesh(), which builds the
// communicators of this rank's groups with Communicator::split().
//
// Hybrid sharding (HSDP) splits the data dimension once more: shard groups of
// `shard_group_size` consecutive data ranks (parameters sharded within one) and replicate
// groups of the data ranks with the same index in their shard group (gradients all-reduced
// across them).
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace dtrain::comm {

enum class MeshDim { Pipeline = 0, Data = 1, Tensor = 2 };
// "pp", "dp", "tp": the names of the dimensions, and of their groups made by split_mesh().
const char* mesh_dim_name(MeshDim d);

struct MeshCoord {
  int pipeline = 0, data = 0, tensor = 0;
  int operator[](MeshDim d) const { return d == MeshDim::Pipeline ? pipeline : d == MeshDim::Data ? data : tensor; }
  bool operator==(const MeshCoord&) const = default;
};

class DeviceMesh {
 public:
  // UserError naming the dimension when one is below 1.
  DeviceMesh(int pipeline, int data, int tensor);

  int size(MeshDim d) const { return dims_[int(d)]; }
  int world() const { return dims_[0] * dims_[1] * dims_[2]; }
  std::string str() const;  // "pp=2 x dp=2 x tp=2"

  // UserError when `rank` is not in [0, world()).
  MeshCoord coord(int rank) const;
  int rank_of(const MeshCoord& c) const;
  // The members of `rank`'s group along `d` (the ranks that differ from it only in the
  // coordinate d), ordered by that coordinate: the group's rank k is the coordinate k.
  std::vector<int> group(MeshDim d, int rank) const;
  // Every group along `d`, ordered by their smallest rank.
  std::vector<std::vector<int>> groups(MeshDim d) const;

  // Hybrid sharding: `shard_group_size` must divide the data size (UserError naming both).
  // The shard group of `rank`: the data ranks with data coordinate in
  // [k*S, (k+1)*S), k = d / S (same pipeline and tensor coordinates), ordered by d.
  std::vector<int> shard_group(int rank, int shard_group_size) const;
  // Its replicate group: the data ranks with the same d % S, ordered by d.
  std::vector<int> replicate_group(int rank, int shard_group_size) const;

 private:
  void check_shard(int shard_group_size) const;
  int dims_[3];
};

// This rank's communicators along each dimension of `mesh`, split from `parent` (whose
// ranks are the mesh's ranks: parent.size() must equal mesh.world(), else UserError).
// Every rank of `parent` must call it, in the same order relative to its other splits.
// With shard_group_size > 0 also the hybrid-sharding groups "dp_shard" and "dp_replicate".
// Size-1 groups are communicators of one rank (their collectives are copies).
struct MeshComms {
  std::unique_ptr<Communicator> pipeline, data, tensor;  // groups "pp", "dp", "tp"
  std::unique_ptr<Communicator> shard, replicate;        // only with shard_group_size > 0
  Communicator& along(MeshDim d) const {
    return *(d == MeshDim::Pipeline ? pipeline : d == MeshDim::Data ? data : tensor);
  }
};
MeshComms split_mesh(Communicator& parent, const DeviceMesh& mesh, int shard_group_size = 0);

}  // namespace dtrain::comm
